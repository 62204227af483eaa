"""Operations: drift measurement, recalibration and scheduled runs."""
