"""Operations on published artifacts: `kvtc eval` (quality), drift measurement, recalibration, scheduled runs."""
