"""The stages' doors: each module reads the composed config once and returns the stage's
frozen, typed job object; below them only typed objects and keyword arguments travel."""
