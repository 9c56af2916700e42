"""What a run is made of: data, Ray, placement, inference engines, worker groups, the generator."""
