"""FSDP2 checks on one device (CUDA with nccl when available, else CPU with gloo), one process:

* σ = 0: bk, ghost and hooks under ``fully_shard`` give the parameters of the unsharded run;
* bf16 ``MixedPrecisionPolicy``: the private gradients of the float32 shards are float32;
* σ > 0 on a zero loss: the noise std per coordinate is σ·C (±3 %);
* a run resumed from a sharded checkpoint equals the uninterrupted one, bit for bit.

Each line ends in OK or FAIL. Run from the repository root:
``torchrun --nproc_per_node=1 scripts/check_fsdp_device.py``.
"""

import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.getcwd())
warnings.simplefilter("ignore")
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader
from opacus_dp import PrivacyEngine
from tests.distributed.workers_fsdp import make_model, dataset, BlockModel, full_params

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
if cuda: torch.cuda.set_device(dev)
mesh = init_device_mesh(dev.type, (1,))
print("torch", torch.__version__, "device", dev, torch.cuda.get_device_name(0) if cuda else "")

def run(mode, fsdp, sigma=0.0, steps=3, zero_loss=False, model=None, ckpt=None, load=None, mp=None):
    torch.manual_seed(0)
    model = (model or make_model(seed=0)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    pe = PrivacyEngine(accountant="rdp")
    torch.manual_seed(5)
    opts = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
    out = pe.make_private(module=model, optimizer=opt, data_loader=DataLoader(dataset(), batch_size=8),
                          noise_multiplier=sigma, max_grad_norm=0.4, grad_sample_mode=mode,
                          fsdp=opts if fsdp else False, noise_generator=None)
    m, o, dl = out[0], out[1], out[-1]
    crit = out[2] if mode == "ghost" else nn.CrossEntropyLoss()
    if load: pe.load_checkpoint(path=load, module=m, optimizer=o)
    grads = []
    for i, (x, y) in enumerate(dl):
        x, y = x.to(dev), y.to(dev)
        if zero_loss: (m(x) * 0).sum().backward()
        else: crit(m(x).float(), y).backward()
        o.step()
        grads.append([p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone() for p in m.parameters()])
        o.zero_grad()
        if i + 1 == steps: break
    if ckpt: pe.save_checkpoint(path=ckpt, module=m, optimizer=o)
    return full_params(m), grads, o, pe

for mode in ("bk", "ghost", "hooks"):
    a, _, o, _ = run(mode, True); b, _, _, _ = run(mode, False)
    err = max(float((x - y).abs().max()) for x, y in zip(a, b))
    print(f"CHECK sigma0 {mode} fsdp-vs-unsharded max|diff|={err:.2e} reducer={type(o.reducer).__name__}", "OK" if err < 1e-5 else "FAIL")
_, g, o, _ = run("bk", True, mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
print("CHECK bf16 grad dtypes", {str(t.dtype) for t in g[-1]}, "device", {str(t.device) for t in g[-1]})
_, g, o, _ = run("bk", True, sigma=1.3, zero_loss=True, model=BlockModel(width=256, n_blocks=1, n_out=64))
noise = torch.cat([t.flatten() for s in g for t in s]) * o.expected_batch_size
print(f"CHECK noise std/(sigma C)={float(noise.std()) / (1.3 * 0.4):.4f} n={noise.numel()}", "OK" if abs(float(noise.std()) / 0.52 - 1) < 0.03 else "FAIL")
d = tempfile.mkdtemp()
whole, _, _, pw = run("bk", True, sigma=0.8, steps=4)
run("bk", True, sigma=0.8, steps=2, ckpt=d)
second, _, _, ps = run("bk", True, sigma=0.8, steps=2, load=d, model=make_model(seed=9))
same = all(torch.equal(x, y) for x, y in zip(whole, second))
print("CHECK resume bit-exact", same, pw.get_epsilon(1e-5) == ps.get_epsilon(1e-5), "OK" if same else "FAIL")
dist.destroy_process_group()
sys.stdout.flush(); os._exit(0)
