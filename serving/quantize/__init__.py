"""Quantization: INT8 and 4-bit compressed-tensors checkpoints of the lineage's model, gated on quality.

`schemes` names what each scheme is, `calibration` draws calibration samples from the lineage,
`entry` is the quantizer process (round-to-nearest with compressed-tensors in the main
environment; SmoothQuant/GPTQ with llmcompressor in its own environment), `report` measures a
checkpoint against its source, and `gate` compares their evaluations. The steps are in
`serving.quantize.steps`.
"""
