"""QLoRA: the model to fine-tune loaded in 4-bit NF4 (double quantization) through bitsandbytes,
LoRA adapters trained on top (`peft.prepare_model_for_kbit_training`).

The adapters are merged for export into a 16-bit (here fp32) copy of the same model, as for LoRA
(`training.align.entry.merge_lora`), with the same parity check against the PEFT model on that copy.
Three things make this exact on CPU as well as on GPUs (each found by measuring, see the README):

- bitsandbytes 0.50 repacks 4-bit weights in place for its avx512-bf16 CPU kernel on the first
  no-grad forward in eval mode (held-out evaluation, generation); backward through the repacked
  weights has no autograd kernel and gives wrong gradients (up to 92% relative error measured), so
  that repacking is switched off on every `Linear4bit`;
- TRL casts the adapters of a quantized model to bf16, and PEFT loads them back as fp32 on resume,
  so a resumed run would train differently: adapters are kept in fp32 from the start;
- DDP needs `ddp_find_unused_parameters=False` and non-reentrant checkpointing with a PEFT model.
"""

from __future__ import annotations

from typing import Any


def load_4bit(path: str, precision: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    try:
        import bitsandbytes as bnb
    except ImportError:  # pragma: no cover (in the lock)
        raise RuntimeError("align.method: qlora needs bitsandbytes (pip install bitsandbytes)") from None
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quantization, device_map={"": device}, dtype=compute
    )
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False}
    )


def adapters_in_fp32(model: Any) -> None:
    """The trainable (adapter) parameters in fp32, as they will be after a resume."""
    import torch

    for parameter in model.parameters():
        if parameter.requires_grad and parameter.dtype != torch.float32:
            parameter.data = parameter.data.float()


def four_bit_layers(model: Any) -> int:
    import bitsandbytes as bnb

    return sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
