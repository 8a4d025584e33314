"""A complete own training loop: ``training: {entrypoint: "own_loop.loop:train"}`` (docs/spec.md, "Your own loop")."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def spirals(n: int, seed: int) -> TensorDataset:
    """Two interleaved 2-D spirals, one class each: synthetic, no download."""
    g = torch.Generator().manual_seed(seed)
    t, y = torch.rand(n, generator=g) * 3 * torch.pi, torch.randint(0, 2, (n,), generator=g)
    sign = (1 - 2 * y).unsqueeze(1)
    x = sign * torch.stack([torch.cos(t), torch.sin(t)], 1) * (t / 10).unsqueeze(1)
    return TensorDataset(x + 0.05 * torch.randn(n, 2, generator=g), y)


@torch.no_grad()
def evaluate(net: nn.Module, loader, ctx) -> tuple[float, float]:
    net.eval()
    loss = correct = count = 0.0
    for x, y in loader:
        out = net(x.to(ctx.device))
        loss += F.cross_entropy(out, y.to(ctx.device), reduction="sum").item()
        correct += (out.argmax(1).cpu() == y).sum().item()
        count += len(y)
    net.train()
    return ctx.mean(loss / count), ctx.mean(correct / count)  # this rank's shard -> the whole test set


def train(ctx) -> None:
    """Runs on every DDP worker; ctx: prepare, loader, teleport, report, checkpoint/restore."""
    width, n = ctx.args.get("width", 64), ctx.args.get("samples", 1024)
    torch.manual_seed(ctx.spec.training.seed)
    model = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))
    state = ctx.restore()  # after a worker failure, a retry or a preemption: where the last checkpoint was
    if state:
        model.load_state_dict(state["model"])
    net = ctx.prepare(model)  # on ctx.device, DDP-wrapped when world_size > 1
    opt = torch.optim.Adam(net.parameters(), lr=ctx.spec.optimizer.lr)
    if state:
        opt.load_state_dict(state["optimizer"])
    train_set = spirals(n, seed=0)
    batches = ctx.loader(train_set)  # this rank's shard, reshuffled every epoch
    test = ctx.loader(spirals(n // 4, seed=1), batch_size=256, shuffle=False)
    acc = float("nan")  # (a run resumed after its last epoch trains none)
    for epoch in ctx.epochs():  # from ctx.start_epoch on
        ctx.teleport(model, F.cross_entropy, train_set, optimizer=opt)  # only in teleport.epochs
        total = 0.0
        for x, y in batches:
            loss = F.cross_entropy(net(x.to(ctx.device)), y.to(ctx.device))
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item()
        test_loss, acc = evaluate(net, test, ctx)
        ctx.report(epoch=epoch, train_loss=ctx.mean(total / len(batches)), test_loss=test_loss, test_acc=acc)
        ctx.checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict()})
    if ctx.is_chief and ctx.artifacts_dir is not None:  # files written here are the job's artifacts (`tlab pull`)
        (ctx.artifacts_dir / "notes.txt").write_text(f"spirals: width {width}, test accuracy {acc:.4f}\n")
