"""Feature maps: the random projection, the kernel estimators, redraw policy, registry and errors."""

import math

import pytest
import torch

from hf_performer import available_feature_maps, gaussian_orthogonal_random_matrix, make_feature_map
from hf_performer.feature_maps import FeatureMap, FavorPlusFeatureMap, register_feature_map


def _kernel_estimate(feature_map, q, k):
    """phi(q).phi(k) for single vectors, literally (values * exp(log_scale))."""
    fq, fk = feature_map(q[None], k[None])
    dense = lambda f: f.values * (1.0 if f.log_scale is None else torch.exp(f.log_scale)[..., None])  # noqa: E731
    return (dense(fq) * dense(fk)).sum(-1).squeeze(0)


def test_registry_lists_the_builtin_maps():
    assert set(available_feature_maps()) >= {"favor+", "trig", "relu", "elu+1"}


@pytest.mark.parametrize("rows", [16, 64, 100])
def test_orthogonal_projection_blocks_are_orthogonal(rows):
    d = 16
    w = gaussian_orthogonal_random_matrix(rows, d, row_norms="fixed", generator=torch.Generator().manual_seed(0))
    assert w.shape == (rows, d)
    assert torch.allclose(w.norm(dim=1), torch.full((rows,), math.sqrt(d)), atol=1e-5)
    for start in range(0, rows, d):
        block = w[start : start + d].double()
        gram = block @ block.T
        assert torch.allclose(gram, d * torch.eye(block.shape[0], dtype=torch.float64), atol=1e-4)


def test_chi_row_norms_match_gaussian_rows():
    d, rows = 16, 4096
    w = gaussian_orthogonal_random_matrix(rows, d, generator=torch.Generator().manual_seed(0))
    # E|g|^2 = d for g ~ N(0, I_d); the norms must not all be sqrt(d).
    assert abs(w.norm(dim=1).square().mean().item() - d) < 0.5
    assert w.norm(dim=1).std() > 0.5


def test_qr_sign_correction_makes_directions_unbiased():
    # Without multiplying Q by sign(diag(R)), LAPACK's QR gives diagonals of a fixed sign bias.
    d, draws = 4, 1000
    generator = torch.Generator().manual_seed(0)
    diagonals = torch.stack(
        [torch.diagonal(gaussian_orthogonal_random_matrix(d, d, row_norms="fixed", generator=generator)) for _ in range(draws)]
    )
    assert diagonals.mean().abs() < 0.1


def test_projection_is_seeded_and_iid_option_works():
    a = make_feature_map("favor+", 8, nb_features=32, seed=3)
    b = make_feature_map("favor+", 8, nb_features=32, seed=3)
    c = make_feature_map("favor+", 8, nb_features=32, seed=4)
    iid = make_feature_map("favor+", 8, nb_features=32, seed=3, orthogonal=False)
    assert torch.equal(a.projection, b.projection)
    assert not torch.equal(a.projection, c.projection)
    gram = iid.projection[:8] @ iid.projection[:8].T
    assert (gram - torch.diag(torch.diagonal(gram))).abs().max() > 1.0  # not orthogonal


@pytest.mark.parametrize("name", ["favor+", "trig"])
def test_random_features_are_unbiased_for_exp_of_the_dot_product(name):
    torch.manual_seed(0)
    d = 8
    q, k = 0.4 * torch.randn(d, dtype=torch.float64), 0.4 * torch.randn(d, dtype=torch.float64)
    estimates = [
        _kernel_estimate(make_feature_map(name, d, nb_features=64, seed=seed).double(), q, k) for seed in range(300)
    ]
    mean = torch.stack(estimates).mean()
    assert abs(mean.item() / math.exp(q @ k) - 1) < 0.03


def test_favor_features_are_positive_and_stabilised_for_huge_inputs():
    fm = make_feature_map("favor+", 16, nb_features=32)
    features = fm.features(1e3 * torch.randn(5, 16))
    assert torch.isfinite(features.values).all() and (features.values >= 0).all()
    assert torch.allclose(features.values.amax(-1), torch.ones(5))
    assert torch.isfinite(features.log_scale).all()


@pytest.mark.parametrize("name", ["favor+", "trig", "elu+1", "hedgehog"])
def test_shifted_key_features_are_the_features_relative_to_the_shift(name):
    # What the chunked kernels' backward uses for keys (the stabiliser is known by then): FAVOR+ computes it with
    # one exp and no row maximum, the other maps rescale their key features.
    kwargs = dict(num_heads=2) if name == "hedgehog" else {}
    feature_map = make_feature_map(name, 8, nb_features=8 if name == "elu+1" else 16, **kwargs).double()
    x = torch.randn(1, 2, 5, 8, dtype=torch.float64) * 2
    features = feature_map.key_features(x)
    log_scale = torch.zeros(1, 2, 5, dtype=torch.float64) if features.log_scale is None else features.log_scale
    shift = log_scale.detach() + torch.rand(1, 2, 5, dtype=torch.float64)  # any per-row shift >= the log-scale
    expected = features.values * torch.exp(log_scale - shift)[..., None] if features.log_scale is not None \
        else features.values
    torch.testing.assert_close(feature_map.shifted_key_features(x, shift), expected)
    if name == "favor+":
        shift[0, 0, 1] = float("inf")  # a padded key the stabiliser left out: 0, not inf * 0
        shifted = feature_map.shifted_key_features(x, shift)
        assert torch.equal(shifted[0, 0, 1], torch.zeros(16, dtype=torch.float64)) and shifted.isfinite().all()


def test_elu_and_relu_maps():
    x = torch.randn(3, 7, 8)
    elu = make_feature_map("elu+1", 8)
    assert elu.nb_features == 8
    assert torch.allclose(elu.features(x).values, torch.nn.functional.elu(x) + 1)
    relu = make_feature_map("relu", 8, nb_features=16)
    values = relu.features(x).values
    assert values.shape == (3, 7, 16) and (values >= 1e-3 - 1e-9).all()


def test_redraw_only_in_training_every_n_calls():
    fm = make_feature_map("favor+", 8, nb_features=16, redraw_interval=2, seed=1)
    first = fm.projection.clone()
    x = torch.randn(1, 4, 8)
    fm.eval()
    for _ in range(5):
        fm(x, x)
    assert torch.equal(fm.projection, first) and int(fm.redraws) == 0
    fm.train()
    fm(x, x)
    fm(x, x)
    assert torch.equal(fm.projection, first)
    fm(x, x)  # third call: interval of 2 reached
    assert not torch.equal(fm.projection, first) and int(fm.redraws) == 1
    # The k-th draw is reproducible from the seed.
    assert torch.equal(fm.projection, fm.draw_projection(1))


def test_redraw_interval_zero_never_redraws():
    fm = make_feature_map("favor+", 8, nb_features=16, redraw_interval=0).train()
    first = fm.projection.clone()
    for _ in range(10):
        fm(torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    assert torch.equal(fm.projection, first)


def test_state_dict_round_trip_keeps_projection_and_counters():
    fm = make_feature_map("favor+", 8, nb_features=16, redraw_interval=1, seed=5).train()
    for _ in range(3):
        fm(torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    state = fm.state_dict()
    assert {"projection", "redraws", "calls"} <= set(state)
    fresh = make_feature_map("favor+", 8, nb_features=16, redraw_interval=1, seed=5)
    assert not torch.equal(fresh.projection, fm.projection)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.projection, fm.projection)
    assert int(fresh.redraws) == int(fm.redraws)


def test_unknown_map_and_bad_options_raise_clear_errors():
    with pytest.raises(ValueError, match="unknown feature map 'favour'.*available: .*favor\\+"):
        make_feature_map("favour", 8)
    with pytest.raises(TypeError, match="bad option for feature map 'favor\\+'"):
        make_feature_map("favor+", 8, orthogonl=True)
    with pytest.raises(ValueError, match="row_norms"):
        make_feature_map("favor+", 8, row_norms="unit")
    with pytest.raises(ValueError, match="even"):
        make_feature_map("trig", 8, nb_features=15)
    with pytest.raises(ValueError, match="exactly head_dim"):
        make_feature_map("elu+1", 8, nb_features=256)
    with pytest.raises(ValueError, match="redraw_interval"):
        make_feature_map("favor+", 8, redraw_interval=-1)


def test_custom_maps_plug_into_the_registry():
    class Squared(FeatureMap):
        name = "squared"

        def __init__(self, head_dim, nb_features=None):
            super().__init__(head_dim, head_dim)
            self.scale = torch.nn.Parameter(torch.ones(head_dim))

        def features(self, x):
            from hf_performer import Features

            return Features((x * self.scale) ** 2 + 1e-3, None)

    register_feature_map("squared", Squared)
    fm = make_feature_map("squared", 4)
    assert isinstance(fm, Squared) and not fm.has_features_vjp
    assert isinstance(make_feature_map("favor+", 4), FavorPlusFeatureMap)
    assert make_feature_map("favor+", 4).has_features_vjp
