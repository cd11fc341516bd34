//! What the parts drive: the container lifecycles and turns of every path ([`lifecycle`]),
//! the scripted model and the broker under test ([`broker`]), and the actor layer's path
//! ([`actors`]).

pub mod actors;
pub mod broker;
pub mod lifecycle;
