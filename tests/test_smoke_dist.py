import torch

import neuron_tp as ntp
import dist


def _body():
    mesh = ntp.init_mesh(tp=2)
    torch.manual_seed(0)
    ref = torch.nn.Linear(7, 6)
    col = ntp.ColumnParallelLinear.from_linear(ref, gather_output=True)
    x = torch.randn(3, 7)
    torch.testing.assert_close(col(x), ref(x))


def test_smoke():
    dist.run(_body, 2)
