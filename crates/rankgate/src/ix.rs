//! Typed indices. The snapshot keeps its per-worker and per-engine data in vectors indexed like
//! the fleet's workers and engines; a [`WorkerIx`] indexes only the former and an [`EngineIx`]
//! only the latter, so one cannot be used for the other (both were `usize` once, 43 sites apart).
//! [`IxVec`] is a `Vec` indexed by one of them, and by nothing else.

use std::marker::PhantomData;
use std::ops::{Index, IndexMut};

/// An index into an [`IxVec`].
pub trait Ix: Copy {
    fn new(i: usize) -> Self;
    fn get(self) -> usize;
}

macro_rules! ix {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(u32);

        impl Ix for $name {
            #[inline]
            fn new(i: usize) -> $name {
                // A fleet is bounded far below u32::MAX workers (config's MAX_WORKERS).
                $name(i as u32)
            }

            #[inline]
            fn get(self) -> usize {
                self.0 as usize
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.fmt(f)
            }
        }
    };
}

ix!(
    /// A worker's place in `fleet.workers`, and so in everything indexed like it (the snapshot's
    /// rank views).
    WorkerIx
);
ix!(
    /// An engine's place in `fleet.engines`, and so in everything indexed like it (the catalog).
    EngineIx
);

/// A `Vec` indexed by `I` alone.
#[derive(Debug, Clone, PartialEq)]
pub struct IxVec<I, T> {
    items: Vec<T>,
    ix: PhantomData<fn(I) -> I>,
}

impl<I: Ix, T> IxVec<I, T> {
    pub fn new() -> IxVec<I, T> {
        Vec::new().into()
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.items.len()
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    #[inline]
    pub fn get(&self, i: I) -> Option<&T> {
        self.items.get(i.get())
    }

    #[inline]
    pub fn get_mut(&mut self, i: I) -> Option<&mut T> {
        self.items.get_mut(i.get())
    }

    pub fn push(&mut self, item: T) -> I {
        self.items.push(item);
        I::new(self.items.len() - 1)
    }

    #[inline]
    pub fn iter(&self) -> std::slice::Iter<'_, T> {
        self.items.iter()
    }

    /// Every index, in order.
    #[inline]
    pub fn indices(&self) -> impl DoubleEndedIterator<Item = I> + ExactSizeIterator + use<I, T> {
        (0..self.items.len()).map(I::new)
    }

    /// Every item with its index.
    #[inline]
    pub fn iter_enumerated(&self) -> impl DoubleEndedIterator<Item = (I, &T)> + '_ {
        self.items.iter().enumerate().map(|(i, t)| (I::new(i), t))
    }

    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.items
    }
}

impl<I: Ix, T> Default for IxVec<I, T> {
    fn default() -> IxVec<I, T> {
        IxVec::new()
    }
}

impl<I, T> From<Vec<T>> for IxVec<I, T> {
    fn from(items: Vec<T>) -> IxVec<I, T> {
        IxVec {
            items,
            ix: PhantomData,
        }
    }
}

impl<I, T> Extend<T> for IxVec<I, T> {
    fn extend<It: IntoIterator<Item = T>>(&mut self, iter: It) {
        self.items.extend(iter)
    }
}

impl<I, T> FromIterator<T> for IxVec<I, T> {
    fn from_iter<It: IntoIterator<Item = T>>(iter: It) -> IxVec<I, T> {
        Vec::from_iter(iter).into()
    }
}

impl<I: Ix, T> Index<I> for IxVec<I, T> {
    type Output = T;

    #[inline]
    fn index(&self, i: I) -> &T {
        &self.items[i.get()]
    }
}

impl<I: Ix, T> IndexMut<I> for IxVec<I, T> {
    #[inline]
    fn index_mut(&mut self, i: I) -> &mut T {
        &mut self.items[i.get()]
    }
}

impl<'a, I: Ix, T> IntoIterator for &'a IxVec<I, T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl<I, T> IntoIterator for IxVec<I, T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_index_reaches_its_own_vector_in_order() {
        let mut v: IxVec<WorkerIx, &str> = IxVec::new();
        let a = v.push("a");
        let b = v.push("b");
        assert_eq!((v[a], v[b]), ("a", "b"));
        assert_eq!(v.indices().collect::<Vec<_>>(), vec![a, b]);
        assert_eq!(v.iter_enumerated().last(), Some((b, &"b")));
        assert_eq!(v.get(WorkerIx::new(2)), None);
    }
}
