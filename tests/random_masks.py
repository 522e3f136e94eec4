"""Random mask descriptions for the tests and the GPU fuzz: trees of the descriptions that test
positions only (causal, windows with one bound or one per head, prefix_lm, global_tokens),
joined by | and &, their sizes drawn up to `reach` positions."""

from jax_sdpa import masks


def positional(draw, heads: int, depth: int, reach: int = 10):
    """A random tree of depth at most `depth` (draw: a random.Random); window bounds, prefix
    lengths and global counts up to about `reach`."""
    if depth == 0 or draw.random() < 0.3:
        leaf = draw.randrange(5)
        if leaf == 0:
            return masks.causal()
        if leaf == 1:
            return masks.sliding_window(draw.randrange(reach * 6 // 10 + 1),
                                        draw.randrange(reach * 4 // 10 + 1))
        if leaf == 2:
            return masks.sliding_window(tuple(draw.randrange(reach * 6 // 10 + 1)
                                              for _ in range(heads)),
                                        draw.randrange(reach * 3 // 10 + 1))
        if leaf == 3:
            return masks.prefix_lm(draw.randrange(reach + 1))
        return masks.global_tokens(draw.randrange(reach * 4 // 10 + 1))
    a, b = (positional(draw, heads, depth - 1, reach) for _ in range(2))
    return a | b if draw.random() < 0.5 else a & b
