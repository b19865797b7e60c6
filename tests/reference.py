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
