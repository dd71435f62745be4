"""What bounds a call inside the server, whatever its protocol: admission (the bearer token, model slots, the answers'
budget, room in the batching queue, the body's time: admission.py) and the bounds it is made of (bounds.py).
Per-address limits are the front proxy's (deploy/proxy/)."""
