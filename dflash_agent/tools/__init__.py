"""The agent's hands: bash and file tools confined to a workspace; they know nothing of models."""
