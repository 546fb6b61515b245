"""Speculative decoding with DeepSeek-V3's MTP module: a re-export of
`zoo.inference.speculative`."""

from zoo.inference.speculative import SpeculativeStats, check_speculative, generate_speculative

__all__ = ["SpeculativeStats", "check_speculative", "generate_speculative"]
