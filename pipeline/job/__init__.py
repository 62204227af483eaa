"""The calibration job: corpus and shard plan, shard store, Ray worker pool, reduce and publish."""
