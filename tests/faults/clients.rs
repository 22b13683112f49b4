//! Placeholder: filled in by the fault tests.
