"""The Ingress and RequestIds replicas load no torch (docs/ARCHITECTURE.md): neither what Serve
imports for them nor the parsing they run on each request, guided and chat requests included. torch
would cost each of those replicas about 180 MB and 2-3 s of start-up. Checked in a fresh interpreter,
since this test process has torch loaded already."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRONT = """
import sys
import deployments.ingress, deployments.request_ids, deployments.routing  # routing: the Ingress's engine router
from app.protocol import openai, triton
job, _ = openai.parse_completion({"model": "m", "prompt": "Hi", "response_format": {"type": "json_object"}}, 16)
assert job.params.guide is not None
openai.parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, 16)
job, _ = triton.parse_generate("ensemble", {"text_input": "Hi", "guided_decoding_guide_type": "regex",
                                            "guided_decoding_guide": "a+"}, "m", 16)
assert job.params.guide is not None
print(sorted(name for name in ("torch", "transformers") if name in sys.modules))
"""


def test_the_ingress_and_request_ids_replicas_load_no_torch():
    run = subprocess.run([sys.executable, "-c", FRONT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["[]"], run.stdout
