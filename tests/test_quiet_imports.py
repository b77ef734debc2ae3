"""fp8conf's own use of TorchAO and torch adds no library chatter to the user's output, and
takes none of the user's own away.

TorchAO logs at import that its extensions did not load here and registers its enums with
pytree (a notice torch logs); torch warns that a check its own ``TreeSpec`` copy makes is
deprecated. Where fp8conf triggers them (its import of TorchAO, its copies of a graph's calling
convention, its command line), they are kept out; the same records from the user's code, after
fp8conf has run, still show.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_CHILD = """
import logging, warnings
warnings.simplefilter("default")
import torch
import fp8conf
model = torch.nn.Sequential(torch.nn.Linear(16, 16))
fp8conf.find_quantized_modules(model)
gm = fp8conf.copy_graph_module(torch.fx.symbolic_trace(model))
fp8conf.QuantizationSignature.from_model(model)
print("FP8CONF DONE", flush=True)
logging.getLogger("torchao").warning("Failed to load the user's own extension")
"""

NOTICES = ("Failed to load /", "Skipping import of cpp extensions", "is an Enum subclass and is now natively supported", "LeafSpec")


def test_fp8conf_triggers_no_library_notices_and_leaves_the_users_alone():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FP8CONF DONE" in result.stdout
    before, users, _ = result.stderr.partition("Failed to load the user's own extension")
    assert users, f"the user's own torchao record after fp8conf ran was hidden:\n{result.stderr[-3000:]}"
    shown = [n for n in NOTICES if n in before]
    assert not shown, f"library notices in fp8conf's output: {shown}\n{before[-3000:]}"
