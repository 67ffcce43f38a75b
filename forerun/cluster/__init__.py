"""forerun on Ray Serve: replicas of one engine behind one OpenAI endpoint, routed by prompt affinity."""
