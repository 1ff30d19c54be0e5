"""Planted bugs for lab 13_weight_quantization: slips a learner plausibly makes; each must fail a test."""
from grader.bugs import PlantedBug

BUGS = [
    # predictions
    PlantedBug("prediction_scales_left_out", "(0.5 + 2.5 / 128) * k * n", "0.5 * k * n"),
    # the zero point counted as an fp16 (2 bytes) where GPTQ and AWQ pack it in 4 bits
    PlantedBug("prediction_fp16_zero", "(0.5 + 2.5 / 128) * k * n", "(0.5 + 4 / 128) * k * n"),
    PlantedBug("prediction_h100_sparse_peak", "compute = 2 * m * k * n / gpu.bf16_flops",
               "compute = 2 * m * k * n / (gpu.bf16_flops * (2 if name == 'H100' else 1))"),
    PlantedBug("prediction_gb_for_gib", "left = 0.9 * a100.memory_bytes - 68_976_648_192 * 1",
               "left = 0.9 * 80e9 - 68_976_648_192 * 1"),
    PlantedBug("prediction_a100_has_fp8", "a100.fp8_flops is not None", "True"),
    # int8 quantizers
    # the scale from the largest value, not the largest magnitude: a row whose extreme is negative saturates
    PlantedBug("scale_from_max_not_absmax", "scale = w.float().abs().amax(dim=1)", "scale = w.float().amax(dim=1)"),
    PlantedBug("per_tensor_where_per_channel", "scale = w.float().abs().amax(dim=1).clamp",
               "scale = w.float().abs().amax().expand(w.shape[0]).clamp"),
    PlantedBug("floor_not_round", "return torch.round(x.float() / scale).clamp(-QMAX, QMAX)",
               "return torch.floor(x.float() / scale).clamp(-QMAX, QMAX)"),
    # amax 0 divides by zero: NaN codes for an all-zero row (a padded token)
    PlantedBug("zero_row_divides_by_zero",
               "scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / QMAX",
               "scale = x.float().abs().amax(dim=1, keepdim=True) / QMAX"),
    # int8_mm / apply
    PlantedBug("int8_overflow_accumulating_in_int8", "        return torch._int_mm(a, b)\n",
               "        return (a @ b).to(torch.int32)\n"),
    PlantedBug("fp32_accumulation", "        return torch._int_mm(a, b)\n",
               "        return (a.float() @ b.float()).to(torch.int32)\n"),
    PlantedBug("weight_scale_left_out", "y = (acc.float() * sx * layer.weight_scale)", "y = (acc.float() * sx)"),
    PlantedBug("residual_dropped", "return add_bias_residual(y, layer.bias, residual)",
               "return add_bias_residual(y, layer.bias, None)"),
    # one GEMM per row: right values, a Python loop (perf only)
    PlantedBug("one_gemm_per_row", "    acc = int8_mm(qx, layer.weight_q.t())\n",
               "    acc = torch.cat([int8_mm(qx[i:i + 1], layer.weight_q.t()) for i in range(qx.shape[0])]) if len(qx) "
               "else int8_mm(qx, layer.weight_q.t())\n"),
    # per-token scales in Python after one .tolist(): right values, no extra torch call per row, a host sync
    PlantedBug("per_token_scales_read_back",
               "    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / QMAX\n",
               "    scale = torch.tensor([[max(max(abs(v) for v in row), torch.finfo(torch.float32).tiny) / QMAX]\n"
               "                          for row in x.float().tolist()]).reshape(-1, 1)\n"),
    # convert_to_channelwise
    # the largest module scale for every row, as vLLM's fp8 path does, but without requantizing the codes
    PlantedBug("channelwise_max_scale_without_requantizing", "return weight_scale.float().repeat_interleave(widths)",
               "return weight_scale.float().max().repeat(int(widths.sum()))"),
    # SmoothQuant
    PlantedBug("smoothquant_wrong_side", "return (x / s).to(x.dtype), (weight * s).to(weight.dtype)",
               "return (x * s).to(x.dtype), (weight / s).to(weight.dtype)"),
    PlantedBug("smoothquant_exponents_swapped", "s = a.pow(alpha) / w.pow(1.0 - alpha)",
               "s = a.pow(1.0 - alpha) / w.pow(alpha)"),
    # max over the input channels of each output row instead of over the rows of each input channel
    PlantedBug("smoothquant_weight_rows_not_columns", "a, w = act_amax.float(), weight.float().abs().amax(dim=0)",
               "a, w = act_amax.float(), weight.float().abs().amax(dim=1)"),
    # group-wise int4
    PlantedBug("zero_not_rounded", "zero = torch.round(-lo / scale)", "zero = -lo / scale"),
    PlantedBug("range_not_widened_to_zero", "lo, hi = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)",
               "lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)"),
    PlantedBug("group_index_off_by_one", "g_idx = torch.arange(q.shape[1], device=q.device) // group_size",
               "g_idx = (torch.arange(q.shape[1], device=q.device) + 1) // group_size % scales.shape[0]"),
    # the nibble order reversed in both: the round trip holds, GPTQ's layout does not
    PlantedBug("nibble_order_reversed", "shifts = torch.arange(per, device=q.device, dtype=torch.int64) * bits",
               "shifts = torch.arange(per - 1, -1, -1, device=q.device, dtype=torch.int64) * bits",
               more=(("shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits",
                      "shifts = torch.arange(per - 1, -1, -1, device=packed.device, dtype=torch.int32) * bits"),)),
    # shifted but not masked: each value keeps the nibbles above it (and >> sign-extends negative words)
    PlantedBug("unpack_mask_missing", "values = (packed[:, None, :] >> shifts[None, :, None]) & (2**bits - 1)",
               "values = packed[:, None, :] >> shifts[None, :, None]"),
    PlantedBug("gptq_zero_minus_one_missing", "return values.reshape(qzeros.shape[0], -1) + 1",
               "return values.reshape(qzeros.shape[0], -1)"),
    # GPTQ's update
    PlantedBug("gptq_no_damping", "    h.diagonal().add_(damp_percent * h.diagonal().mean())\n", ""),
    # RTN with each group's range taken from drifting columns: the error never moves on
    PlantedBug("gptq_no_error_propagation", "        weight[:, i:] -= err[:, None] * u[i, i:][None, :]\n", ""),
    PlantedBug("gptq_hessian_not_inverted",
               "u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)",
               "u = torch.linalg.cholesky(h, upper=True)"),
    PlantedBug("gptq_error_not_divided_by_diagonal", "err = (weight[:, i] - (code - zeros[g]) * scales[g]) / u[i, i]",
               "err = weight[:, i] - (code - zeros[g]) * scales[g]"),
    # the update along column i of U (the lower factor's row) instead of row i: the wrong columns move
    PlantedBug("gptq_update_along_a_column_of_u", "weight[:, i:] -= err[:, None] * u[i, i:][None, :]",
               "weight[:, i:] -= err[:, None] * u[i:, i][None, :]"),
    # each group's scale and zero from the weights as loaded, not as updated (AutoGPTQ's static_groups=False)
    PlantedBug("gptq_groups_from_original_weights", "group = weight[:, i:i + group_size]",
               "group = w.double()[:, i:i + group_size]"),
    PlantedBug("prediction_hessian_n_by_n", "\"hessian_bytes\": k * k * 4", "\"hessian_bytes\": n * n * 4"),
    PlantedBug("prediction_hessian_fp64", "\"hessian_bytes\": k * k * 4", "\"hessian_bytes\": k * k * 8"),
    PlantedBug("prediction_update_whole_matrix", "sum(n * (k - i) for i in range(k))", "n * k * k"),
    # AWQ's scale search
    PlantedBug("awq_scale_on_the_wrong_side", "quantize_groupwise(w.float() * s[None, :], bits, group_size)",
               "quantize_groupwise(w.float() / s[None, :], bits, group_size)",
               more=(("dequantize_groupwise(q, scales, zeros, group_size) / s[None, :]",
                      "dequantize_groupwise(q, scales, zeros, group_size) * s[None, :]"),)),
    PlantedBug("awq_not_scaled_back", "w_hat = dequantize_groupwise(q, scales, zeros, group_size) / s[None, :]",
               "w_hat = dequantize_groupwise(q, scales, zeros, group_size)"),
    PlantedBug("awq_max_not_mean", "x_mean = x.float().abs().reshape(-1, x.shape[-1]).mean(dim=0)",
               "x_mean = x.float().abs().reshape(-1, x.shape[-1]).amax(dim=0)"),
    PlantedBug("awq_grid_reaches_one", "alpha = i / n_grid", "alpha = i / (n_grid - 1)"),
    # Q4_1
    PlantedBug("q4_1_min_added_before_scaling", "return (q.float() * d + m).reshape(-1)",
               "return ((q.float() + m) * d).reshape(-1)"),
    PlantedBug("q4_1_nibbles_interleaved", "q = torch.cat([qs & 0x0F, qs >> 4], dim=1)",
               "q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 32)"),
    PlantedBug("q4_1_d_and_m_swapped", "d = blocks[:, 0:2].contiguous()", "d = blocks[:, 2:4].contiguous()",
               more=(("m = blocks[:, 2:4].contiguous()", "m = blocks[:, 0:2].contiguous()"),)),
]
