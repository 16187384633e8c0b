"""The step engine: collect → exchange → invert → precondition → apply, and the assembler
that builds a composition's stages once."""
