"""The pure core: tokenizers, model formats, prompt rendering, tool declarations, reconstruction.

No IO here except loading a tokenizer's files; reconstruction is a pure function from
(model, messages, tools, response) to ids.
"""
