"""llama.cpp's llama-bench alone on the four SmolLM2-135M files (F32, BF16, Q8_0 exported by specdec; the shipped Q4_1), 2 threads, context 200: python docs/measurements/llamacpp_curves.py BIN_DIR OUT.json"""
import json, os, sys, tempfile
from pathlib import Path
sys.path.insert(0, str(Path(__file__).parent))
from cost_curves import llama_bench
from specdec.commands.gguf import export
from specdec.zoo import zoo_path
BIN = Path(sys.argv[1])
work = Path(tempfile.mkdtemp(prefix="specdec-llb-"))
folder = zoo_path("smollm2-135m")
files = {k.upper(): export(folder, work / f"smollm2-{k}.gguf", k) for k in ("f32", "bf16", "q8_0")}
files["Q4_1"] = Path(os.path.realpath(zoo_path("smollm2-135m-q4_1") / "model.gguf"))
out = {name: llama_bench(BIN, path, 2) for name, path in files.items()}
for name, row in out.items():
    print(name, json.dumps(row), flush=True)
Path(sys.argv[2]).write_text(json.dumps({"threads": 2, "context": 200, "llama.cpp": out}, indent=1) + "\n")
