#!/usr/bin/env python3
"""PyTorch reference figures for the GPU bench (docs/gpus.md, "Figures").

Measured on the same machine and in the same run as our bench (scripts/gpu-check.sh runs it
from the bundle's run.sh):

  torch_ref case=matmul_bf16_8192 ms=... TFLOPs=...        torch.matmul, CUDA events
  torch_ref case=gpt_f32 ms_per_step=... tokens_per_s=... TFLOPs=...
                                                           PyTorch eager training step of
                                                           train_gpt's model

The GPT is train_gpt's model (examples/train_gpt.rs, dtensor-nn's GptConfig::small widened
by the flags): byte vocabulary (256), token embedding without position embedding, pre-norm
blocks `h = x + attn(rms1(x))`, `y = h + mlp(rms2(h))`, RMSNorm with a weight (eps 1e-5),
attention through one fused QKV projection with biases, RoPE on interleaved pairs (base
10000), causal softmax, an output projection with bias; an MLP of width 4*hidden with biases
and tanh GELU; a final RMSNorm; an untied LM head without bias; the mean cross-entropy;
global gradient-norm clipping at 1.0; AdamW (lr 3e-3, betas 0.9/0.95, eps 1e-8, weight decay
0.01 on matrices only). f32 runs with TF32 off, as our f32 cuBLAS GEMMs run; `gpt_bf16_autocast`
is the mixed-precision variant (bf16 compute, f32 parameters), for `train_gpt --bf16`.

Without PyTorch or without a CUDA device it prints `torch_ref: not run: <why>` and exits 0.
`--cpu-smoke` runs tiny sizes on the CPU (wall-clock timing) to check the script itself.
"""

import argparse
import math
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences (train_gpt's default)")
    p.add_argument("--steps", type=int, default=10, help="timed training steps (after 3 warm-up steps)")
    p.add_argument("--gemm", type=int, default=8192, help="m = n = k of the matmul cases")
    p.add_argument("--skip-bf16-gpt", action="store_true", help="only the f32 GPT step")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU (checks the script)")
    return p.parse_args()


def build_model(torch, hidden, layers, heads, seq, vocab=256):
    nn = torch.nn
    F = torch.nn.functional

    class RmsNorm(nn.Module):
        def __init__(self, n, eps=1e-5):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):
            scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (x.float() * scale).to(x.dtype) * self.weight.to(x.dtype)

    def rope_tables(d):
        # Pair p of a head rotates by pos / base^(2p/d).
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv[None, :]
        return torch.cos(ang).float(), torch.sin(ang).float()

    def rope(x, cos, sin):
        # x: [batch, heads, seq, d]; pairs (x[2p], x[2p+1]).
        x0, x1 = x[..., 0::2], x[..., 1::2]
        c, s = cos.to(x.dtype), sin.to(x.dtype)
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(hidden, 3 * hidden, bias=True)
            self.out = nn.Linear(hidden, hidden, bias=True)
            cos, sin = rope_tables(hidden // heads)
            self.register_buffer("cos", cos, persistent=False)
            self.register_buffer("sin", sin, persistent=False)

        def forward(self, x):
            b, s, h = x.shape
            d = h // self.heads
            q, k, v = self.qkv(x).view(b, s, self.heads, 3, d).permute(3, 0, 2, 1, 4)
            q = rope(q, self.cos[:s], self.sin[:s])
            k = rope(k, self.cos[:s], self.sin[:s])
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).reshape(b, s, h))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(hidden, 4 * hidden, bias=True)
            self.fc2 = nn.Linear(4 * hidden, hidden, bias=True)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1 = RmsNorm(hidden)
            self.attn = Attention()
            self.norm2 = RmsNorm(hidden)
            self.mlp = Mlp()

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(vocab, hidden)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = RmsNorm(hidden)
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, ids, targets):
            x = self.embedding(ids)
            for blk in self.blocks:
                x = blk(x)
            logits = self.head(self.norm(x)).float()
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))

    return Gpt()


def step_flops(hidden, layers, seq, batch, vocab=256):
    """Model FLOPs of one training step: 6 per parameter-token of the matmuls, plus the
    causal attention's score and value products (half of the full s*s, forward and
    backward)."""
    per_layer = 3 * hidden * hidden + hidden * hidden + 8 * hidden * hidden
    matmul_params = layers * per_layer + hidden * vocab
    tokens = batch * seq
    return 6 * matmul_params * tokens + 6 * layers * seq * hidden * tokens


class Timer:
    """CUDA events on a GPU, the wall clock (after a synchronize) on the CPU."""

    def __init__(self, torch, cuda):
        self.torch, self.cuda = torch, cuda

    def start(self):
        if self.cuda:
            self.t0 = self.torch.cuda.Event(enable_timing=True)
            self.t1 = self.torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.w0 = time.perf_counter()

    def stop_ms(self):
        if self.cuda:
            self.t1.record()
            self.t1.synchronize()
            return self.t0.elapsed_time(self.t1)
        return (time.perf_counter() - self.w0) * 1e3


def matmul_case(torch, timer, device, n, dtype, name):
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    for _ in range(5):
        torch.matmul(a, b)
    reps = 20
    timer.start()
    for _ in range(reps):
        torch.matmul(a, b)
    ms = timer.stop_ms() / reps
    print(f"torch_ref case=matmul_{name}_{n} ms={ms:.3f} TFLOPs={2 * n**3 / (ms * 1e-3) / 1e12:.1f}", flush=True)


def gpt_case(torch, timer, device, args, name, autocast):
    torch.manual_seed(1234)
    model = build_model(torch, args.hidden, args.layers, args.heads, args.seq).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    g = torch.Generator(device="cpu").manual_seed(7)
    ids = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g).to(device)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

    def step():
        opt.zero_grad(set_to_none=True)
        if autocast:
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
                loss = model(x, y)
        else:
            loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss

    for _ in range(3):
        loss = step()
    timer.start()
    for _ in range(args.steps):
        loss = step()
    ms = timer.stop_ms() / args.steps
    loss = loss.item()
    if not math.isfinite(loss):
        raise RuntimeError(f"{name}: the loss is {loss}")
    tokens = args.batch * args.seq
    flops = step_flops(args.hidden, args.layers, args.seq, args.batch)
    print(
        f"torch_ref case={name} ms_per_step={ms:.2f} tokens_per_s={tokens / (ms * 1e-3):.0f} "
        f"TFLOPs={flops / (ms * 1e-3) / 1e12:.1f} loss={loss:.4f} hidden={args.hidden} "
        f"layers={args.layers} heads={args.heads} seq={args.seq} batch={args.batch}",
        flush=True,
    )
    del model, opt


def main():
    args = parse_args()
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        print(f"torch_ref: not run: import torch failed: {e}")
        return 0
    if args.cpu_smoke:
        args.hidden, args.layers, args.seq, args.heads = 64, 2, 32, 4
        args.batch, args.steps, args.gemm = 2, 2, 128
        device = torch.device("cpu")
        cuda = False
    else:
        if not torch.cuda.is_available():
            print(f"torch_ref: not run: torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})")
            return 0
        device = torch.device("cuda", 0)
        cuda = True
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"torch_ref device={torch.cuda.get_device_name(0)} torch={torch.__version__} cuda={torch.version.cuda}", flush=True)
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        print(f"torch_ref: error: hidden {args.hidden} / heads {args.heads} is not an even head dim")
        return 2
    timer = Timer(torch, cuda)
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.float32, "f32")]:
        matmul_case(torch, timer, device, args.gemm, dtype, name)
    gpt_case(torch, timer, device, args, "gpt_f32", autocast=False)
    if not args.skip_bf16_gpt:
        gpt_case(torch, timer, device, args, "gpt_bf16_autocast", autocast=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
