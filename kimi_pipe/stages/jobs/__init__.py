"""The stages' doors: each module turns the composed config of one stage into its frozen job
object, once; below the stages only the typed job and keyword arguments travel (issue 42)."""
