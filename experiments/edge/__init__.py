"""Edge placement: the fleet, its routing, residency and scaling (claims R1-R3 and the fleet on Ray)."""
