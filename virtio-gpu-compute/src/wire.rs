//! Little-endian field encoding and the `wire_struct!` macro that gives every
//! message body a fixed `#[repr(C)]` layout with no padding.

use crate::WireError;

/// A value with a fixed little-endian encoding.
pub trait Wire: Sized {
    /// Encoded size in bytes.
    const SIZE: usize;
    /// Appends the encoding to `out`.
    fn put(&self, out: &mut Vec<u8>);
    /// Reads one value from the front of `r`.
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError>;
}

/// A cursor over untrusted bytes; every read is bounds-checked.
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// Takes exactly `n` bytes or fails with `Truncated`.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or(WireError::Truncated)?;
        let s = self.buf.get(self.pos..end).ok_or(WireError::Truncated)?;
        self.pos = end;
        Ok(s)
    }

    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The bytes not yet read.
    pub fn rest(&mut self) -> &'a [u8] {
        let s = &self.buf[self.pos..];
        self.pos = self.buf.len();
        s
    }
}

macro_rules! impl_wire_int {
    ($($t:ty),*) => {$(
        impl Wire for $t {
            const SIZE: usize = std::mem::size_of::<$t>();
            fn put(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.to_le_bytes());
            }
            fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
                let b = r.take(Self::SIZE)?;
                let mut a = [0u8; std::mem::size_of::<$t>()];
                a.copy_from_slice(b);
                Ok(<$t>::from_le_bytes(a))
            }
        }
    )*};
}
impl_wire_int!(u8, u16, u32, u64, i32, i64);

impl<const N: usize> Wire for [u8; N] {
    const SIZE: usize = N;
    fn put(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(self);
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let mut a = [0u8; N];
        a.copy_from_slice(r.take(N)?);
        Ok(a)
    }
}

impl<const N: usize> Wire for [u32; N] {
    const SIZE: usize = 4 * N;
    fn put(&self, out: &mut Vec<u8>) {
        for v in self {
            v.put(out);
        }
    }
    fn get(r: &mut Reader<'_>) -> Result<Self, WireError> {
        let mut a = [0u32; N];
        for v in a.iter_mut() {
            *v = u32::get(r)?;
        }
        Ok(a)
    }
}

/// Declares a `#[repr(C)]` wire struct. Field order is wire order; a
/// compile-time check proves the in-memory layout has no padding, so the
/// `repr(C)` struct and the wire bytes describe the same layout.
macro_rules! wire_struct {
    ($(#[$m:meta])* pub struct $name:ident { $($(#[$fm:meta])* pub $f:ident : $t:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub struct $name { $($(#[$fm])* pub $f: $t),* }

        impl $crate::wire::Wire for $name {
            const SIZE: usize = 0 $(+ <$t as $crate::wire::Wire>::SIZE)*;
            fn put(&self, out: &mut Vec<u8>) {
                $( $crate::wire::Wire::put(&self.$f, out); )*
            }
            fn get(r: &mut $crate::wire::Reader<'_>) -> Result<Self, $crate::WireError> {
                Ok($name { $($f: <$t as $crate::wire::Wire>::get(r)?),* })
            }
        }

        const _: () = assert!(
            std::mem::size_of::<$name>() == <$name as $crate::wire::Wire>::SIZE,
            "wire struct has padding"
        );
    };
}
pub(crate) use wire_struct;
