"""The device a worker decodes on: choosing it, host-device transfers, kernel strategies, contention, syncs."""
