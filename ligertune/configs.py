"""Architectures shipped by name, for random-init runs (`model.config: llama3-8b`).

The numbers are the public config.json values of each model family; the weights are not
needed to benchmark or to smoke-test a recipe offline. `tiny-llama` matches the bundled
tokenizer and is what the quickstart trains.
"""

from __future__ import annotations

from typing import Any

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500000.0}

SHIPPED_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=352,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      bos_token_id=128000, eos_token_id=128001,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        bos_token_id=128000, eos_token_id=128001, rope_parameters=_LLAMA3_ROPE),
    "llama3.2-3b": dict(model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        bos_token_id=128000, eos_token_id=128001, rope_parameters=_LLAMA3_ROPE),
    "mistral-7b": dict(model_type="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "gemma-2b": dict(model_type="gemma", vocab_size=256000, hidden_size=2048, intermediate_size=16384,
                     num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1, head_dim=256,
                     max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gemma2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216,
                      num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      max_position_embeddings=8192, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                      final_logit_softcapping=30.0, attn_logit_softcapping=50.0, query_pre_attn_scalar=256,
                      sliding_window=4096, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gemma3-1b": dict(model_type="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
                      num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                      max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh",
                      query_pre_attn_scalar=256, sliding_window=512),
    "phi3-mini": dict(model_type="phi3", vocab_size=32064, hidden_size=3072, intermediate_size=8192,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                      max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}
