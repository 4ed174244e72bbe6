"""Simulated instances: the real engine core and services with a timing model in place of the model.

``simulator.timing_model`` (torch-free) holds a :class:`~simulator.timing_model.TimingProfile`,
one instance kind's KV capacity and step and pull times; ``simulator/profiles/`` the built-in
profiles; ``python -m simulator.measure_profile`` measures a profile from the real engine on the
host at hand. What a profile is and where each built-in one's figures come from: docs/simulator.md.
"""
