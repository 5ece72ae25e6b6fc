"""The places a store's bytes live, behind one interface (docs/design.md, "Tiers")."""
