//! The vgpu VMM library. This stage holds the admin side: a small HTTP/1.1
//! client for the REST APIs served over unix sockets, used by `vgpuctl`.

pub mod http;
