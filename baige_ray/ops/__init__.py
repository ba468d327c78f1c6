"""Operations: event log, metrics, status and plots."""
