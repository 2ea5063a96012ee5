"""fp32 bit patterns read by NumPy, the reference for the router's ordering keys (``model.moe.router.ordered_int``)."""

import numpy as np


def np_ordered_int(x):
    """Sign times the IEEE-754 bit pattern of |x| (int32), from the bits themselves."""
    bits = np.asarray(x, np.float32).view(np.int32)
    magnitude = bits & np.int32(0x7FFFFFFF)
    return np.where(bits < 0, -magnitude, magnitude).astype(np.int32)


def every_exponent():
    """Each power of two of fp32 (subnormal to largest), its neighbours either side and a random value in each
    binade, both signs, as ``[1, n]``: where a ``log2`` estimate of the exponent can round across a binade's edge."""
    powers = np.ldexp(np.float32(1), np.arange(-149, 128)).astype(np.float32)
    inside = powers * np.random.default_rng(1).uniform(1.0, 2.0, powers.size).astype(np.float32)
    values = np.concatenate(
        [powers, np.nextafter(powers, np.float32(0)), np.nextafter(powers, np.float32(np.inf)), inside]
    )
    values = values[np.isfinite(values)]
    return np.concatenate([values, -values]).reshape(1, -1)
