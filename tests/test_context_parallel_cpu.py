"""Why engine.context_parallel is not a recipe key yet: torch's ring attention has no CPU path.

torch 2.13's context_parallel turns SDPA's inputs into sequence-sharded DTensors and handles
only the CUDA attention kernels (_scaled_dot_product_flash/efficient/cudnn_attention, which
have no CPU kernels). CPU SDPA dispatches to _scaled_dot_product_flash_attention_for_cpu,
for which DTensor has no sharding strategy. This test fails once a torch release runs it:
then context parallelism can be built and tested on CPU, and the key brought back.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import context_parallel
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
q = torch.randn(1, 2, 8, 4)
try:
    with context_parallel(mesh, buffers=[q], buffer_seq_dims=[2]):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    print("ran on CPU")
except NotImplementedError as err:
    print(f"refused: {err}")
for op in ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention"):
    print(op, "has a CPU kernel:", torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CPU"))
from accord.distributed.group import exit_after_shutdown, shutdown
shutdown()
exit_after_shutdown(0)  # as accord's workers leave: no interpreter teardown after a process group
"""


@pytest.mark.slow
@pytest.mark.subprocess
def test_torch_context_parallel_has_no_cpu_attention_path(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path / "store")], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert (
        "refused: Operator aten._scaled_dot_product_flash_attention_for_cpu.default "
        "does not have a sharding strategy registered." in lines
    )
    assert "_scaled_dot_product_flash_attention has a CPU kernel: False" in lines
    assert "_scaled_dot_product_efficient_attention has a CPU kernel: False" in lines
