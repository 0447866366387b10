"""The `@triton.jit` kernels and their shared helpers, as plain Triton source files.

  mx_tile             shared helpers: MX quantization of a tile, dot_scaled operand layouts,
                      row-masked tile loads, the online-softmax step, named constants
                      (LOG2E, E8M0_*, F32_*)
  quantize            mx_quantize_kernel
  mx_gemm             mx_mm_kernel (with its epilogue ops)
  mx_gemm_fp4         fp4_mm_kernel: the FP4 GEMM (MXFP4, NVFP4; packed E2M1 operands)
  attention           mx_attention_fwd_kernel
  attention_backward  mx_attention_bwd_{preprocess,dkdv,dq}_kernel
  flash_attention     flash_attention_{fwd,dkdv,dq}_kernel: bf16 flash attention, the
                      reference the MX attention kernels' compiled code is compared with

Triton's `@triton.jit` decides when it decorates a function (at import) whether it makes an
interpreter function (TRITON_INTERPRET=1) or a compiled-mode one, and an interpreted kernel can
only call interpreted helpers. The launchers therefore get these modules from
`mxcompile.triton_templates.loader.kernel_module`, which imports this package once per mode.
The modules import each other relatively, so that each import stays within one mode.
"""
