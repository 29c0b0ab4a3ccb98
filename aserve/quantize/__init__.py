"""`aserve quantize`: seed 004's built-in quantization tool, on llm-compressor (`pip install 'aserve[quantize]'`).

  cli.py          the command line (seed 004's single-dash spellings too); every argument checked before work
  plan.py         `QuantizePlan`: the checked request (input folder, type, dtype, group size, calibration)
  calibration.py  calibration token sequences: a token-id file, a JSONL of texts, or the built-in set
  default_texts.py  the built-in calibration texts (chat questions and short passages)
  recipes.py      a quantization type -> llm-compressor modifiers (GPTQ, AWQ, SmoothQuant, RTN, FP8)
  run.py          load the model, calibrate and quantize (llm-compressor's oneshot), save a checkpoint

The output is a compressed-tensors checkpoint (`quant_method: compressed-tensors` in config.json) that
`aserve --model OUT` serves with no quantization flag, and vLLM loads as written.
"""
