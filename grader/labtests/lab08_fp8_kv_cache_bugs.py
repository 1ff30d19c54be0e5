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
    # capacity and the prediction
    PlantedBug("capacity_kv_in_weight_dtype", "memory.kv_cache_bytes_per_token(config, kv_dtype)",
               "memory.kv_cache_bytes_per_token(config, weight_dtype)"),
    PlantedBug("prediction_forgets_k_and_v", "kv = 16 * 4096 * 2 * 32 * 8 * 128 * 2", "kv = 16 * 4096 * 32 * 8 * 128 * 2"),
]
