"""mindcv 0.3.0 families beyond test_real_models' set, streamed with the README's usage:
each was refused at offload() before issue #26 (a classifier, a conv head or stem pinned in
the root; mobilenet_v3's two classifier Dense layers that fit alone but not as a pair at
lookahead 0). Small inputs and classes, 3 passes, each equal to the resident model."""
import sys
import types

import numpy as np
import pytest

from _stream_check import stream_and_compare

try:
    import tqdm  # noqa: F401  (mindcv imports it for download progress bars only)
except ImportError:
    sys.modules["tqdm"] = types.SimpleNamespace(tqdm=None)
mindcv = pytest.importorskip("mindcv")


@pytest.mark.parametrize("name, size, fraction, classes", [
    ("ghostnet_050", 32, 0.47, 100),          # its root (conv_head, classifier) was 48%: 0.63 needed
    ("efficientnet_b0", 32, 0.3, 1000),       # a classifier above every unit share
    ("repvgg_a0", 32, 0.3, 1000),
    ("mobilenet_v3_small_100", 32, 0.42, 100), # two classifier Dense layers: 0.62 needed
])
def test_mindcv_family_streams_at_lookahead_0(ms, tmp_path, name, size, fraction, classes):
    from mindcv.models import create_model
    ms.set_seed(1)
    model = create_model(name, num_classes=classes)
    x = ms.Tensor(np.random.default_rng(0).standard_normal((1, 3, size, size)).astype(np.float32))
    plan, _ = stream_and_compare(model, [(x,)], str(tmp_path / "s"), fraction=fraction, lookahead=0)
    assert plan.units
