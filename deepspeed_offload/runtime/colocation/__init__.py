"""Colocation: ``engine.offload_states()`` / ``reload_states()`` with the state already on the host
(RL rollouts beside training), agreed on every rank before anything moves."""
