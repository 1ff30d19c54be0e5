"""Planted bugs for lab 08_fp8_kv_cache: each must make at least one official test fail."""
from grader.bugs import PlantedBug

BUGS = [
    # scales
    PlantedBug("fnuz_max_240", "amax / fp8_max(dtype)", "amax / 240.0"),
    PlantedBug("zero_amax_gives_zero_scale", "torch.where(amax > 0, amax / fp8_max(dtype), torch.ones_like(amax))",
               "amax / fp8_max(dtype)"),
    # quantize / dequantize
    PlantedBug("no_saturation", ".clamp(-limit, limit).to(dtype)", ".to(dtype)"),
    PlantedBug("divide_in_input_dtype", "(x.float() / per_head(scale))", "(x / per_head(scale))"),
    PlantedBug("double_rounding_through_bf16", ".clamp(-limit, limit).to(dtype)",
               ".clamp(-limit, limit).to(torch.bfloat16).to(dtype)"),
    PlantedBug("per_head_scale_on_head_dim", "(x.float() / per_head(scale))", "(x.float() / scale)"),
    PlantedBug("dequantize_divides", "(x.float() * per_head(scale)).to(dtype)", "(x.float() / per_head(scale)).to(dtype)"),
    # per-head maxima, calibrated scales
    PlantedBug("amax_without_abs", "x.abs().amax(dim=(0, 2)).float()", "x.amax(dim=(0, 2)).float()"),
    PlantedBug("per_head_flag_ignored", "x if per_head else x.amax(dim=1)", "x.amax(dim=1)"),
    # the write path
    PlantedBug("padding_rows_written", "    keep = slot_mapping >= 0\n", "    keep = slot_mapping >= -1\n"),
    # the cache viewed as [slots, block_size, head_dim]: right only when block size equals the KV head count
    PlantedBug("cache_view_block_size_for_heads", "num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]",
               "num_kv_heads, head_dim = key_cache.shape[1], key_cache.shape[3]"),
    PlantedBug("v_quantized_with_k_scale", "quantize_fp8(v, v_scale, fmt)", "quantize_fp8(v, k_scale, fmt)"),
    # int8 beside fp8
    # no rounding: the cast to int8 truncates toward zero
    PlantedBug("int8_truncates", "return torch.round(x.float() / per_head(scale)).clamp(",
               "return (x.float() / per_head(scale)).clamp("),
    PlantedBug("int8_clamps_at_minus_128", "per_head(scale)).clamp(-INT8_MAX, INT8_MAX)",
               "per_head(scale)).clamp(-INT8_MAX - 1, INT8_MAX)"),
    PlantedBug("int8_dequantize_divides", "return (x.float() * per_head(scale)).to(dtype)\n    ### END SOLUTION\n\n\n"
               "def quantize_int8_per_token_head", "return (x.float() / per_head(scale)).to(dtype)\n    ### END "
               "SOLUTION\n\n\ndef quantize_int8_per_token_head"),
    # one scale per token over its heads, not per token and head
    PlantedBug("per_token_scale_over_heads", "amax = x.float().abs().amax(dim=-1)\n",
               "amax = x.float().abs().amax(dim=(1, 2))[:, None].expand(x.shape[0], x.shape[1])\n"),
    PlantedBug("per_token_head_zero_vector_scale_zero",
               "scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))\n    return torch.round",
               "scale = amax / INT8_MAX\n    return torch.round"),
    # the static int8 scale taken from the e4m3 one: every value saturates
    PlantedBug("round_trip_int8_with_fp8_scale", "int8_scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))",
               "int8_scale = fp8_scale"),
    # the int8 cache written through the fp8 quantizer
    PlantedBug("int8_cache_written_as_fp8", "    if fmt == torch.int8:\n        k, v = quantize_int8(k, k_scale), "
               "quantize_int8(v, v_scale)\n    elif fmt is not None:\n", "    if fmt is not None:\n"),
    PlantedBug("prediction_int8_scale_as_fp16", "vectors * (128 + 4)", "vectors * (128 + 2)"),
    PlantedBug("prediction_int8_forgets_k_and_v", "vectors = 2 * 32 * 8", "vectors = 32 * 8"),
    # capacity and the prediction
    PlantedBug("capacity_kv_in_weight_dtype", "memory.kv_cache_bytes_per_token(config, kv_dtype)",
               "memory.kv_cache_bytes_per_token(config, weight_dtype)"),
    PlantedBug("prediction_forgets_k_and_v", "kv = 16 * 4096 * 2 * 32 * 8 * 128 * 2", "kv = 16 * 4096 * 32 * 8 * 128 * 2"),
]
