//! Saving and restoring a model's parameters and optimizer state (see below).
