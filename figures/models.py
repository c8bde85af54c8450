"""Small models for the figures: an MLP, a CNN for 8x8 digits, and a character-level GPT.

Every layer with weights is an ``nn.Linear`` or ``nn.Conv2d`` (what MKOR and K-FAC
precondition) except the GPT's embeddings and LayerNorms, which go to the backbone.
"""
import torch
from torch import nn
from torch.nn import functional as F


def mlp(d_in, width, d_out, depth=2):
    layers, d = [], d_in
    for _ in range(depth):
        layers += [nn.Linear(d, width), nn.GELU()]
        d = width
    return nn.Sequential(*layers, nn.Linear(d, d_out))


def digits_cnn(channels=(16, 32), classes=10):
    """8x8x1 -> conv3x3 -> conv3x3 (stride 2) -> 4x4 map -> linear classifier."""
    c1, c2 = channels
    return nn.Sequential(
        nn.Conv2d(1, c1, 3, padding=1), nn.GELU(),
        nn.Conv2d(c1, c2, 3, stride=2, padding=1), nn.GELU(),
        nn.Flatten(), nn.Linear(c2 * 16, classes))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """A pre-LayerNorm decoder-only transformer over characters (no weight tying)."""

    def __init__(self, vocab, block, width, depth, heads):
        super().__init__()
        self.block = block
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(block, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.apply(self._init)
        for b in self.blocks:  # GPT-2's scaled init of the residual projections
            for m in (b.proj, b.out):
                nn.init.normal_(m.weight, std=0.02 / (2 * depth) ** 0.5)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def n_params(model):
    return sum(p.numel() for p in model.parameters())
