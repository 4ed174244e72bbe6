"""The committed gRPC stubs: current with the .proto files, and importable the way users import them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = ROOT / "splitserve" / "v1"


def test_committed_stubs_match_a_fresh_generation(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)], check=True)
    generated = sorted((tmp_path / "splitserve" / "v1").glob("*_pb2*.py*"))
    assert [p.name for p in generated] == sorted(p.name for p in STUB_DIR.glob("*_pb2*.py*"))
    stale = [p.name for p in generated if p.read_bytes() != (STUB_DIR / p.name).read_bytes()]
    assert not stale, f"stubs are stale, run: python proto/generate.py ({stale})"


def test_stubs_import_as_splitserve_v1_and_leave_proto_to_proto_plus() -> None:
    code = (
        "from splitserve.v1 import disaggregation_pb2_grpc, generation_pb2_grpc\n"
        "import proto, sys\n"
        "print(proto.__file__)\n"
    )
    # From the repository root, where a top-level proto/ folder could shadow the name.
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True).stdout
    assert "site-packages" in out and str(ROOT / "proto") not in out


def test_messages_round_trip() -> None:
    from splitserve.v1 import disaggregation_pb2, generation_pb2

    handle = disaggregation_pb2.KVHandle(block_ids=[3, 1, 2], num_tokens=40, pull_token=b"\x01" * 16)
    request = disaggregation_pb2.DecodeRequest(
        request_id="r",
        prompt_token_ids=[1, 2],
        first_token_id=7,
        kv=handle,
        sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=8),
    )
    parsed = disaggregation_pb2.DecodeRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.sampling.HasField("temperature") and not parsed.sampling.HasField("top_p")
