"""Structured outputs: constraints compiled to grammars (llguidance) and each step's token
bitmask for the constrained rows. Host side only; the sampler applies the bitmask on device."""

from jaxllm.structured.grammar import GrammarCompiler, grammar_text
from jaxllm.structured.matchers import GrammarTask, StructuredOutputs, bitmask_width

__all__ = ["GrammarCompiler", "GrammarTask", "StructuredOutputs", "bitmask_width", "grammar_text"]
