{
  description = "Fused linear cross-entropy: a Triton kernel for the Hugging Face kernels loader";

  inputs.kernel-builder.url = "github:huggingface/kernels";

  outputs =
    { self, kernel-builder, ... }:
    kernel-builder.lib.genKernelFlakeOutputs {
      inherit self;
      path = ./.;
    };
}
