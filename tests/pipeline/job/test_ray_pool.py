"""How the pool hands the KVTC_* settings to its actors: by the environment a local Ray inherits or
the job's runtime environment when they carry them (the actors then run in the workers Ray starts
with the job, none is shut down as idle), else by a runtime environment of the actors' own."""
from kvtc.pipeline.job.ray_pool import PoolSettings, actor_env_options


def test_actors_need_no_runtime_environment_when_the_workers_have_the_settings():
    env = {"KVTC_CACHE": "/cache"}
    assert actor_env_options(env, {}, env_inherited=True) == {}
    assert actor_env_options(env, {"KVTC_CACHE": "/cache", "RAY_USAGE_STATS_ENABLED": "0"}, env_inherited=False) == {}
    assert actor_env_options({}, {}, env_inherited=False) == {}


def test_actors_get_their_own_runtime_environment_otherwise():
    env = {"KVTC_CACHE": "/cache", "KVTC_TEST_KILL_ON_SHARD": "2:/tmp/m"}
    assert actor_env_options(env, {}, env_inherited=False) == {"runtime_env": {"env_vars": env}}
    assert actor_env_options(env, {"KVTC_CACHE": "/other"}, env_inherited=False) == {"runtime_env": {"env_vars": env}}
    assert PoolSettings(workers=1).env_inherited is False
