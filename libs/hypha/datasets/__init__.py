"""The dataset format every role agrees on (manifest, slice files), its synthetic
generators and the preparation that turns raw arrays or text into slices."""
