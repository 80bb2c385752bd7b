"""train.py's allocator default: expandable segments unless the user set either allocator variable."""

from torchtitan_glm.components.cuda_alloc import DEFAULT_ALLOC_CONF, default_alloc_conf


def test_sets_expandable_segments_when_unset():
    env = {}
    assert "trainer's default" in default_alloc_conf(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_ALLOC_CONF}


def test_leaves_the_users_setting_alone():
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env = {name: "max_split_size_mb:512"}
        assert default_alloc_conf(env) == f"{name}=max_split_size_mb:512"
        assert env == {name: "max_split_size_mb:512"}
