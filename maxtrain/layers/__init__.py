"""Building blocks of the decoder: single-device math whose parameters carry logical axes."""
