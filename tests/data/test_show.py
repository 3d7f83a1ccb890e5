"""tools/show_data.py's view of which tokens carry loss (maxtrain/data/show.py)."""

import numpy as np

from maxtrain.data.show import loss_view


def test_a_document_shows_its_first_token_then_its_targets():
    """Two documents and padding: each document's text starts with its first input token (no
    token predicts it: it was missing from the view), then its targets, the loss-carrying
    ones in [[ ]]."""
    inputs = np.array([10, 11, 12, 13, 20, 21, 22, 0, 0])
    segments = np.array([1, 1, 1, 1, 2, 2, 2, 0, 0])
    targets = np.where(np.roll(segments, -1) == segments, np.roll(inputs, -1), 0)
    loss_mask = np.array([0, 1, 1, 0, 1, 1, 0, 0, 0])
    decode = lambda ids: "".join(f"<{i}>" for i in ids)  # noqa: E731
    view = loss_view(inputs, targets, loss_mask, segments, decode)
    assert view == "<10><11>[[<12><13>]]<0> | <20>[[<21><22>]]<0> | <2 padding>"
