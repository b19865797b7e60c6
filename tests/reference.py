"""Short, obviously-correct numpy references for every kernel (float64 inside).

Both the CPU and the CUDA backend tests compare against these.
"""

import math

import numpy as np

SQRT_HALF = 1 / math.sqrt(2)


def linear_forward(x, w, b=None):
    y = x.astype(np.float64) @ w.astype(np.float64).T
    return y if b is None else y + b


def linear_backward(dout, x, w):
    dout = dout.astype(np.float64)
    return dout @ w, dout.T @ x, dout.sum(axis=0)  # dinp, dweight, dbias


def relu(x):
    return np.maximum(x, 0)


def relu_backward(x, dout):
    return dout * (x > 0)


_erf = np.vectorize(math.erf)


def gelu(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + _erf(x * SQRT_HALF))


def gelu_backward(x, dout):
    x = x.astype(np.float64)
    cdf = 0.5 * (1 + _erf(x * SQRT_HALF))
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)
    return dout * (cdf + x * pdf)


def tanh_backward(y, dout):
    return dout * (1 - y.astype(np.float64) ** 2)


def layernorm(x, w, b, eps):
    x = x.astype(np.float64)
    mean = x.mean(axis=1, keepdims=True)
    var = x.var(axis=1, keepdims=True)
    rstd = 1 / np.sqrt(var + eps)
    return (x - mean) * rstd * w + b, mean[:, 0], rstd[:, 0]


def layernorm_backward(dout, x, w, eps):
    x, dout = x.astype(np.float64), dout.astype(np.float64)
    _, mean, rstd = layernorm(x, w, np.zeros_like(w), eps)
    norm = (x - mean[:, None]) * rstd[:, None]
    dnorm = dout * w
    dinp = rstd[:, None] * (dnorm - dnorm.mean(1, keepdims=True) - norm * (dnorm * norm).mean(1, keepdims=True))
    return dinp, (dout * norm).sum(0), dout.sum(0)


def cross_entropy(logits, targets):
    """Sum of per-row losses, number correct, gradient of the sum."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    rows = np.arange(len(targets))
    loss = -logp[rows, targets].sum()
    grad = np.exp(logp)
    grad[rows, targets] -= 1
    return loss, int((logits.argmax(axis=1) == targets).sum()), grad


def mse(pred, target):
    diff = pred.astype(np.float64) - target
    return (diff**2).sum(), 2 * diff


def sgd(p, g, buf, lr, momentum, weight_decay, nesterov):
    """One torch.optim.SGD step (dampening 0), written from its documented pseudocode."""
    p, g, buf = p.astype(np.float64), g.astype(np.float64), buf.astype(np.float64)
    g = g + weight_decay * p
    if momentum:
        buf = momentum * buf + g
        g = g + momentum * buf if nesterov else buf
    return p - lr * g, buf


def adam(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, decoupled):
    """One torch.optim.Adam (decoupled=False) or AdamW (decoupled=True) step."""
    p, g = p.astype(np.float64), g.astype(np.float64)
    if decoupled:
        p = p * (1 - lr * weight_decay)
    else:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    mhat = m / (1 - beta1**step)
    vhat = v / (1 - beta2**step)
    return p - lr * mhat / (np.sqrt(vhat) + eps), m, v


def embedding(idx, wte, wpe):
    B, T = idx.shape
    return (wte[idx].astype(np.float64) + wpe[:T]).reshape(B * T, -1)


def embedding_backward(dout, idx, V, Tmax):
    B, T = idx.shape
    d = dout.astype(np.float64).reshape(B, T, -1)
    dwte = np.zeros((V, d.shape[2]))
    np.add.at(dwte, idx.reshape(-1), d.reshape(B * T, -1))
    dwpe = np.zeros((Tmax, d.shape[2]))
    dwpe[:T] = d.sum(axis=0)
    return dwte, dwpe


def _split_heads(qkv, B, T, H):
    C = qkv.shape[1] // 3
    q, k, v = (qkv[:, i * C : (i + 1) * C].reshape(B, T, H, C // H).transpose(0, 2, 1, 3) for i in range(3))
    return q, k, v


def attention(qkv, T, H, drop=None):
    """Causal multi-head attention, as nanoGPT's CausalSelfAttention after c_attn: (out[B·T, C], att).
    ``drop``: a factor [B, H, T, T] (1/(1 − p) or 0) on the probabilities before they weigh v (attn_dropout)."""
    qkv = qkv.astype(np.float64)
    B = qkv.shape[0] // T
    q, k, v = _split_heads(qkv, B, T, H)
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1])
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    att = np.exp(s - s.max(axis=-1, keepdims=True))
    att /= att.sum(axis=-1, keepdims=True)
    y = (att if drop is None else att * drop) @ v
    return y.transpose(0, 2, 1, 3).reshape(B * T, -1), att


def attention_backward(dout, qkv, T, H, drop=None):
    qkv = qkv.astype(np.float64)
    B = qkv.shape[0] // T
    q, k, v = _split_heads(qkv, B, T, H)
    _, att = attention(qkv, T, H)
    factor = 1.0 if drop is None else drop
    dy = dout.astype(np.float64).reshape(B, T, H, -1).transpose(0, 2, 1, 3)
    datt = (dy @ v.transpose(0, 1, 3, 2)) * factor
    dv = (att * factor).transpose(0, 1, 3, 2) @ dy
    ds = att * (datt - (att * datt).sum(axis=-1, keepdims=True)) / math.sqrt(q.shape[-1])
    dq, dk = ds @ k, ds.transpose(0, 1, 3, 2) @ q
    return np.concatenate([d.transpose(0, 2, 1, 3).reshape(B * T, -1) for d in (dq, dk, dv)], axis=1)


def gpt_loss_and_grads(p, idx, targets, *, n_layer, n_head, eps=1e-5, drop=None):
    """nanoGPT's GPT (tied head), written out in float64: the mean cross-entropy over every position and
    the gradient of every parameter, by nanoGPT's names. ``p``: name -> array; without ``.bias`` entries,
    the model of bias = False. ``drop(site, shape)``: dropout's factor (1/(1 − p) or 0) at a site, the
    embedding's 0, block i's 4(i + 1) + 0 attention, + 1 and + 2 its residual branches (hpctrain/nn/dropout.py)."""
    P = "transformer."
    B, T = idx.shape
    C = p[P + "wpe.weight"].shape[1]
    factor = (lambda site, shape: 1.0) if drop is None else drop  # noqa: E731
    lin = lambda x, name: linear_forward(x, p[name + ".weight"], p.get(name + ".bias"))  # noqa: E731
    bias = lambda name: p.get(name, 0.0)  # noqa: E731
    x = embedding(idx, p[P + "wte.weight"], p[P + "wpe.weight"]) * factor(0, (B * T, C))
    saved = []
    for i in range(n_layer):
        h, site = f"{P}h.{i}.", 4 * (i + 1)
        fa, f1, f2 = factor(site, (B, n_head, T, T)), factor(site + 1, (B * T, C)), factor(site + 2, (B * T, C))
        ln1, _, _ = layernorm(x, p[h + "ln_1.weight"], bias(h + "ln_1.bias"), eps)
        qkv = lin(ln1, h + "attn.c_attn")
        a, _ = attention(qkv, T, n_head, None if drop is None else fa)
        x2 = x + lin(a, h + "attn.c_proj") * f1
        ln2, _, _ = layernorm(x2, p[h + "ln_2.weight"], bias(h + "ln_2.bias"), eps)
        f = lin(ln2, h + "mlp.c_fc")
        g = gelu(f)
        saved.append((x, ln1, qkv, a, x2, ln2, f, g, (fa, f1, f2)))
        x = x2 + lin(g, h + "mlp.c_proj") * f2
    hf, _, _ = layernorm(x, p[P + "ln_f.weight"], bias(P + "ln_f.bias"), eps)
    logits = hf @ p[P + "wte.weight"].astype(np.float64).T
    n = B * T
    loss, _, dlogits = cross_entropy(logits, targets.reshape(-1))
    dlogits /= n
    grads = {}
    grads[P + "wte.weight"] = dlogits.T @ hf
    dh = dlogits @ p[P + "wte.weight"]
    dx, grads[P + "ln_f.weight"], grads[P + "ln_f.bias"] = layernorm_backward(dh, x, p[P + "ln_f.weight"], eps)

    def lin_back(d, xin, name):
        dinp, grads[name + ".weight"], grads[name + ".bias"] = linear_backward(d, xin, p[name + ".weight"])
        return dinp

    for i in reversed(range(n_layer)):
        h = f"{P}h.{i}."
        x_in, ln1, qkv, a, x2, ln2, f, g, (fa, f1, f2) = saved[i]
        dg = lin_back(dx * f2, g, h + "mlp.c_proj")
        dln2 = lin_back(gelu_backward(f, dg), ln2, h + "mlp.c_fc")
        d, grads[h + "ln_2.weight"], grads[h + "ln_2.bias"] = layernorm_backward(dln2, x2, p[h + "ln_2.weight"], eps)
        dx2 = dx + d
        da = lin_back(dx2 * f1, a, h + "attn.c_proj")
        dln1 = lin_back(attention_backward(da, qkv, T, n_head, None if drop is None else fa), ln1, h + "attn.c_attn")
        d, grads[h + "ln_1.weight"], grads[h + "ln_1.bias"] = layernorm_backward(dln1, x_in, p[h + "ln_1.weight"], eps)
        dx = dx2 + d
    dwte, grads[P + "wpe.weight"] = embedding_backward(dx * factor(0, (B * T, C)), idx, *p[P + "wte.weight"].shape[:1],
                                                       p[P + "wpe.weight"].shape[0])
    grads[P + "wte.weight"] = grads[P + "wte.weight"] + dwte
    return loss / n, {name: g for name, g in grads.items() if name in p}
