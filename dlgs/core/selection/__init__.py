"""Selection: threshold controllers, their bank, and the selection and packing of a layer."""
