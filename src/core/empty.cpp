// Placeholder so that an area with no sources yet still forms a library.
